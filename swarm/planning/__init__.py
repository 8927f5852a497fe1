"""Planning a swarm's pipeline from measured speeds and links: cuts, layout, microbatch, windows, codecs."""
