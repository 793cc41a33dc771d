import { defineConfig } from "vite";

// The console is served by the gateway at /admin (routing inside it is by URL fragment).
export default defineConfig({
  base: "/admin/",
  oxc: { jsx: { runtime: "automatic", importSource: "preact" } },
  build: { outDir: "dist", emptyOutDir: true, sourcemap: false, chunkSizeWarningLimit: 400 },
  test: {
    include: ["test/**/*.test.ts", "test/**/*.test.tsx"],
    environment: "happy-dom",
  },
});
