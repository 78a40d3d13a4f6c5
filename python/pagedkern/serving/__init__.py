"""Serving: the `pagedkern-serve` command line (streams to stdout) and its --trace narrator."""
