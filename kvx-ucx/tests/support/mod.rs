pub mod two_process;
