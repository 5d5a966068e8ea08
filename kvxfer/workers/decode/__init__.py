"""The decode worker: reserves pages, admits pushed KV by ImmCounter, generates tokens."""
