# cellgate's R kernel: Debian's IRkernel, with run-time package installs refused.
#
# The sandbox's library directories are read-only and its network goes only where the
# policy's egress rules allow, so an install would fail anyway, slowly and with a message
# about mirrors. It is refused at once instead, saying why. Plots come as PNG (and the
# text form): what every cellgate surface can show.
local({
  refuse <- function(...) {
    policy <- Sys.getenv("CELLGATE_POLICY", "this session's policy")
    stop(sprintf(paste0(
      "cellgate: installing R packages at run time is not allowed by policy '%s'; ",
      "the R kernel offers the packages installed with it ",
      "(see library() or installed.packages())"), policy), call. = FALSE)
  }
  # Both bindings: `install.packages()` finds the attached package's, `utils::` the
  # namespace's.
  for (env in list(asNamespace("utils"), as.environment("package:utils"))) {
    for (name in c("install.packages", "update.packages", "download.packages")) {
      unlockBinding(name, env)
      assign(name, refuse, envir = env)
      lockBinding(name, env)
    }
  }
})
# Values show as text, tables also as HTML, plots as PNG: IRkernel's Markdown and LaTeX
# copies of every value would each become an artifact of their own. A plain vector or
# factor has no HTML form, so it arrives as text only (in the result's stdout).
options(
  jupyter.display_mimetypes = c("text/plain", "text/html", "image/png", "image/svg+xml"),
  jupyter.plot_mimetypes = c("text/plain", "image/png"),
  bitmapType = "cairo"
)
local({
  text_only <- function(obj, ...) NULL
  for (class in c("logical", "integer", "numeric", "character", "complex", "factor", "Date", "POSIXct", "difftime")) {
    registerS3method("repr_html", class, text_only, envir = asNamespace("repr"))
  }
})
IRkernel::main()
