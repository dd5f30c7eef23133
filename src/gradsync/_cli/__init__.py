"""The command line: gradsync launch and gradsync status."""
