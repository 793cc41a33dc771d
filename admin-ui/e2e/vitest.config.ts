import { defineConfig } from "vitest/config";

// The end-to-end suite: a real `cachet serve` on real Postgres and Redis, driven through
// Debian's Chromium by playwright-core, with traffic from the official anthropic SDK.
export default defineConfig({
  test: {
    include: ["e2e/**/*.e2e.ts"],
    environment: "node",
    testTimeout: 300_000,
    hookTimeout: 180_000,
    fileParallelism: false,
    sequence: { concurrent: false },
  },
});
