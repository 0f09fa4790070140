pub mod ptx;
