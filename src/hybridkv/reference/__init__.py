"""CPU reference DeepSeek-V4 attention: a dense path and a paged path that must agree."""
