"""``soakd batch``: an OpenAI Batch API input file sent with bounded concurrency, every output
validated, resumable accounting in the run store (``input``: the file; ``runner``: sending,
retries, the store, the output and error files)."""
