"""The report: tables as numeric frames (tables), physical checks on measured figures (physical_checks), the source
articles' claims checked (claims), cost (cost), the recommendation (recommendation), plots (plots), and the Markdown
and HTML rendering (render, templates/)."""
