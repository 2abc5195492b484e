"""What each dflash command does, on a workspace; the CLI only parses and prints."""
