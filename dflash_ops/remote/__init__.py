"""What runs at a place: the one site program (`site.sh`) and the client that calls it."""
