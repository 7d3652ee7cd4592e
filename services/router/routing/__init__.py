"""Routing: the instances the router knows (pools, health, breakers, discovery) and the policies that choose one."""
