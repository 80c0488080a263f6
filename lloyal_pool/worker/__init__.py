"""Code that runs only inside worker processes. The client never imports this package's native module."""
