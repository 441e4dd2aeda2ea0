"""Build-time pages for dlspark's site: the configuration reference and the benchmark tables."""
