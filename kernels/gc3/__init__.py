"""kernels/gc3"""
