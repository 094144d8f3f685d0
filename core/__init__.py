"""Baton's job side: the controller, the workers and the values they share."""
