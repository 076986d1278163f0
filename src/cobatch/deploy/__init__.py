"""Deployments of cobatch on other serving systems: ray (Ray Serve)."""
