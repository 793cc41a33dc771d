// Components rendered into a DOM (happy-dom): labelled fields tie their error to the input,
// and the login form refuses an empty submission with a message before calling the API.

import { render } from "preact";
import { act } from "preact/test-utils";
import { afterEach, describe, expect, it, vi } from "vitest";
import { Field } from "../src/components/ui";
import { LoginPage } from "../src/pages/login";

afterEach(() => {
  render(null, document.body);
  vi.unstubAllGlobals();
});

describe("Field", () => {
  it("labels its input and describes it by its error", () => {
    act(() => render(<Field id="rpm" label="Requests per minute" value="0" error="at least 1" />, document.body));
    const input = document.getElementById("rpm") as HTMLInputElement;
    const label = document.querySelector('label[for="rpm"]');
    expect(label?.textContent).toBe("Requests per minute");
    expect(input.getAttribute("aria-invalid")).toBe("true");
    expect(document.getElementById(input.getAttribute("aria-describedby")!)?.textContent).toBe("at least 1");
  });
});

describe("the login form", () => {
  it("asks for both fields before sending anything", async () => {
    const fetch = vi.fn();
    vi.stubGlobal("fetch", fetch);
    act(() => render(<LoginPage />, document.body));
    const form = document.querySelector("form")!;
    await act(async () => {
      form.dispatchEvent(new Event("submit", { bubbles: true, cancelable: true }));
    });
    expect(document.querySelector('[role="alert"]')?.textContent).toBe("Enter your username and password.");
    expect(fetch).not.toHaveBeenCalled();
  });
});
