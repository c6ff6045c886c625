"""The multimodal chapter: procedural scene data, image datasets and the VQ-VAE."""
