"""raytrec: elastic 2D sparse-parallel training of TorchRec models on Ray."""
