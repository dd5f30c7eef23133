"""The sync directory's storage: files and directories, reached without following links."""
