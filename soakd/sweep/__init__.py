"""``soakd sweep``: the load raised step by step until the knee (``plan``: the rule; ``runner``:
the composition; ``render``: table, Markdown, HTML)."""
