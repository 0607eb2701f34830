"""Transformer architectures written as Graph builders over the canonical ops (ViT, SigLIP, CLIP, BERT, GPT-2)."""
