//! Small tools every room uses: outside text made safe to print ([`text`]), threads and runtimes of their own
//! ([`runtime`]), the open-file limit ([`limits`]), connection caps and timeouts for a served socket
//! ([`bounded`]) and Unix-socket gRPC channels ([`uds`]).

pub mod authority;
pub mod bounded;
pub mod files;
pub mod limits;
pub mod runtime;
pub mod text;
pub mod uds;
