"""A group of parameter servers kept identical over torch.distributed (gloo): rendezvous, sync points, reductions."""
