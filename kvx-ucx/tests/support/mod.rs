pub(crate) mod two_process;
