"""Model architectures written in plain torch (no torchvision)."""
