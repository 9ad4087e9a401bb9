pub mod block_pool;
