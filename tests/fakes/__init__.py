"""Hand-written fakes for tests (fakes over mocks: same names as the real thing)."""
