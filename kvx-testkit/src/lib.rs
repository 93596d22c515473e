#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub mod conformance;
pub mod sim;
pub mod xproc;
