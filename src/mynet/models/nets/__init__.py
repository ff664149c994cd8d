"""Plain torch.nn networks: image batch (N, C, H, W) in, class logits (N, num_classes) out."""
