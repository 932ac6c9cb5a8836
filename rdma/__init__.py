"""rdma."""
