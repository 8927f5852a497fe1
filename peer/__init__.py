"""One peer process: RPC handlers, the stage runtime, checkpoints and the serving loop."""
