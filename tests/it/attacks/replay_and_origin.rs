//! Attacks on the HTTP edge: replay kernels that escape a tenant's caps, and cross-site or
//! DNS-rebinding requests against a gateway without a token (issue 13, items 1 and 4).
