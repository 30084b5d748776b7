"""Windows, quantile sketches and (later) drift, leak and throttle detection."""
