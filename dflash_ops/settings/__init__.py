"""The operator's settings: deploy.toml, the remembered target, one command's workspace."""
