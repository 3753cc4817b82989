"""Misbehaving real servers on 127.0.0.1, and what batchrun must survive against them."""
