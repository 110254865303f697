"""Block tables: the compiled table store and the engine-side mirror."""
