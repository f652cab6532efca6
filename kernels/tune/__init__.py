"""Choosing a winner for one problem: narrow the candidates, build them through the backends, verify, time, pick."""
