//! Copies the web client's chart libraries and the API reference page's Swagger UI
//! (installed by `./dev setup` with `npm ci` in `web-client/`, locked by its
//! package-lock.json) into OUT_DIR, where `gateway::web` and `gateway::v1::docs` embed them. Without them the build still succeeds, with a stand-in script that makes the page
//! say, where a chart would be, that `./dev setup` installs them (the browser test fails on
//! it, so a release without charts cannot pass the tests).

use std::path::Path;

const VENDORED: &[(&str, &str)] = &[
    (
        "plotly.min.js",
        "plotly.js-cartesian-dist-min/plotly-cartesian.min.js",
    ),
    ("vega.min.js", "vega/build/vega.min.js"),
    ("vega-lite.min.js", "vega-lite/build/vega-lite.min.js"),
    ("vega-embed.min.js", "vega-embed/build/vega-embed.min.js"),
    (
        "swagger-ui-bundle.js",
        "swagger-ui-dist/swagger-ui-bundle.js",
    ),
    ("swagger-ui.css", "swagger-ui-dist/swagger-ui.css"),
];

fn main() {
    let out_dir = std::env::var("OUT_DIR").expect("cargo sets OUT_DIR for build scripts");
    let modules = Path::new("web-client/node_modules");
    println!("cargo:rerun-if-changed=web-client/package-lock.json");
    for (name, source) in VENDORED {
        let source = modules.join(source);
        println!("cargo:rerun-if-changed={}", source.display());
        let target = Path::new(&out_dir).join(name);
        if source.exists() {
            std::fs::copy(&source, &target).expect("copy a vendored web-client library");
        } else {
            println!(
                "cargo:warning=web-client: {} is missing; run ./dev setup (npm ci) to bundle the chart libraries",
                source.display()
            );
            let stand_in = if name.ends_with(".css") {
                format!("/* cellgate was built without {name}: run ./dev setup */\n")
            } else {
                format!("console.warn('cellgate was built without {name}: run ./dev setup');\n")
            };
            std::fs::write(&target, stand_in).expect("write a stand-in asset");
        }
    }
}
