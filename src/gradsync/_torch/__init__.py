"""What the "gradsync" torch backend (gradsync.torch) is built from; imports torch."""
