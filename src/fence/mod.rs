//! Operator inputs that take a GPU out of service and put it back: the control socket behind `fence` and
//! `release` ([`control`]), detectors' report files ([`dir`]) and the Node annotation ([`annotation`]). Each
//! reaches the health engine through the monitor as a `fenced` condition, never past it.

pub mod annotation;
pub mod control;
pub mod dir;
