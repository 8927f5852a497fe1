"""Reading the model while it trains: `swarm generate` and `swarm eval` through the swarm's live peers."""
