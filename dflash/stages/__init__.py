"""Stages compose the modules; they never import each other."""
