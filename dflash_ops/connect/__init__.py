"""How commands reach a place: argv quoting, local and SSH transports, host or container."""
