//! Attacks on the listener: connections held open before authentication, idle keep-alives and
//! connection floods (issue 13, item 2).
