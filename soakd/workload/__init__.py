"""What soakd sends: scenarios, prompt sources, the stratified mix and arrival processes."""
