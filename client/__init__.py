"""ClientApp: local training and the extra records (gradients, sensitivity) it reports."""
