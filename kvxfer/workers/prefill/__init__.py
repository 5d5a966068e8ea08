"""The prefill worker: computes prompts and pushes each layer's KV into a decoder."""
