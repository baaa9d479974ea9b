"""Capture and replay of the draft step and verify (torch.compile, CUDA graphs)."""
