//! Target model families. Gemma 4 is the one the host runs today.
pub mod gemma4;
