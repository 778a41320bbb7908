//! Attacks that fingerprint the host from inside the sandbox: boot id, kernel command line,
//! host paths in mountinfo, the working directory, HOME and the interpreter's prefix (issue 13,
//! item 5).
