#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub mod baseline;
pub mod chaos;
pub mod child;
pub mod conformance;
pub mod etcd;
pub mod flood;
pub mod hostile;
pub mod matrix;
pub mod sim;
pub mod soak;
pub mod xproc;
