"""qsapp: a Flower / PyTorch app in the shape of Flower's quickstart-pytorch."""
